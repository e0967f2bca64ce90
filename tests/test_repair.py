"""Field-level repair (structgen/repair.py, engine/repair.py) on the real default model: a field
a validator rejects is decoded again from where its value starts, the text before it kept."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import pytest
from pydantic import AfterValidator, BaseModel, field_validator, model_validator

import structgen
from structgen.engine.config import EngineConfig

PROMPT = "Give me a city as JSON."  # greedy: {"name": "New York City", "country": "USA", ...}
CLEAN_PROMPT = "Describe Paris as JSON."


class City(BaseModel):
    name: str
    country: str

    @field_validator("country")
    @classmethod
    def not_the_usa(cls, value: str) -> str:
        if value == "USA":
            raise ValueError("must not be the USA")
        return value


def _never(value: str) -> str:
    raise ValueError("no value is right")


class NeverValid(BaseModel):
    name: str
    country: Annotated[str, AfterValidator(_never)]


class NoNewCity(BaseModel):
    name: str
    country: str

    @model_validator(mode="after")
    def not_new(self) -> NoNewCity:
        if self.name.startswith("New"):
            raise ValueError("no new things")  # names no field: the whole object goes back
        return self


class NotUsaModel(BaseModel):
    name: str
    country: str

    @model_validator(mode="after")
    def not_usa(self) -> NotUsaModel:
        if self.country == "USA":
            raise ValueError("country must not be the USA")  # names `country`: back to it
        return self


@pytest.fixture(scope="module")
def llm(model_dir) -> structgen.LLM:
    from structgen.api import default_llm

    return default_llm()


@pytest.fixture(scope="module")
def rejected(llm) -> structgen.OutputValidationError:
    """What repair=0 (the default) does with PROMPT: raises as before repair existed."""
    with pytest.raises(structgen.OutputValidationError) as info:
        llm.generate(City, PROMPT, max_tokens=30)
    assert info.value.attempts == []
    return info.value


def test_a_rejected_field_is_decoded_again_and_the_text_before_it_is_kept(llm, rejected):
    done = llm.complete(City, PROMPT, max_tokens=30, repair=1)
    assert done.value.country != "USA"
    cut = rejected.text.index('"country": "') + len('"country": "')
    assert done.text[:cut] == rejected.text[:cut]  # `name` untouched, token for token
    assert done.stats.repairs == 1 and done.stats.repair_tokens >= 1


def test_llguidance_repairs_the_same_field(model_dir, rejected):
    with structgen.LLM(backend="llguidance", config=EngineConfig(device="cpu", max_seq_len=512)) as llm:
        done = llm.complete(City, PROMPT, max_tokens=30, repair=1)
    assert done.value.country != "USA" and done.stats.repairs == 1
    assert done.value.name == _loose(rejected.text)["name"]


def test_a_validator_that_always_fails_uses_every_repair_and_the_error_lists_each_attempt(llm):
    with pytest.raises(structgen.OutputValidationError) as info:
        llm.generate(NeverValid, PROMPT, max_tokens=30, repair=2)
    attempts = info.value.attempts
    assert len(attempts) == 3 and all(a.field == ("country",) for a in attempts)
    countries = [_loose(a.text)["country"] for a in attempts]
    assert len(set(countries)) == 3  # the retry never writes a rejected value again
    assert all("no value is right" in a.error for a in attempts)
    assert "repair=2" in str(info.value) and "country" in str(info.value)
    assert info.value.stats.repairs == 2 and info.value.stats.repair_tokens >= 2


class ForcedKind(BaseModel):
    kind: Annotated[Literal["city"], AfterValidator(_never)]
    name: str


def test_repair_stops_once_the_grammar_leaves_no_other_value(llm):
    with pytest.raises(structgen.OutputValidationError) as info:
        llm.generate(ForcedKind, PROMPT, max_tokens=30, repair=3)
    first, again = info.value.attempts  # the retry could only write the same text
    assert first.text == again.text and first.field == ("kind",)


def test_a_model_validator_naming_no_field_rolls_back_the_whole_object(llm):
    done = llm.complete(NoNewCity, PROMPT, max_tokens=30, repair=1)
    assert not done.value.name.startswith("New") and done.stats.repairs == 1


def test_a_model_validator_naming_a_field_rolls_back_to_that_field(llm):
    done = llm.complete(NotUsaModel, PROMPT, max_tokens=30, repair=1)
    assert done.value.name == "New York City" and done.value.country != "USA"
    assert done.stats.repairs == 1


def test_a_clean_request_batched_with_a_repaired_one_is_unaffected(llm):
    alone = llm.complete(City, CLEAN_PROMPT, max_tokens=30)
    repaired, clean = llm.complete_batch(City, [PROMPT, CLEAN_PROMPT], max_tokens=30, repair=1)
    assert repaired.stats.repairs == 1 and repaired.value.country != "USA"
    assert clean.stats.repairs == 0
    assert clean.token_ids == alone.token_ids and clean.stats.forward_passes == alone.stats.forward_passes


def test_agenerate_repairs_too(llm):
    value = asyncio.run(llm.agenerate(City, PROMPT, max_tokens=30, repair=1))
    assert value.country != "USA"


def test_streaming_refuses_repair(llm):
    with pytest.raises(structgen.InvalidParameterError, match="repair"):
        llm.stream(City, PROMPT, repair=1)


def _loose(text: str) -> dict:
    return json.loads(text)
